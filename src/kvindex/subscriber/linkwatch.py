"""Why a publisher can't be followed, from its SUB socket's monitor events (no I/O here).

ZMQ reconnects by itself and says nothing: a misspelt host, a port where nothing listens
and a CURVE relay that refuses us all look like a subscriber that waits forever. `LinkWatch`
reads the monitor's events of one publisher and says, in one line, what is wrong:

- no connect attempt ever starts (`CONNECT_RETRIED` with no `CONNECT_DELAYED`): the host
  name does not resolve;
- attempts start and fail: nothing accepts connections there;
- TCP connects but no ZMQ handshake follows: something else listens there (an HTTP port?);
- the handshake fails: the security mechanisms differ (CURVE on one side only), the server
  refused our client key, or (CURVE, no detail) our server key is not the server's.
  Whether ZMQ says the mechanisms differ depends on timing: the side that finds out closes
  the connection, and if the other has not read its greeting yet (Linux drops what it had
  not read when the close resets the connection) all it reports is a handshake cut
  (EPIPE or ECONNRESET, no detail). On some machines every attempt ends so; a cut is then
  said as the likely mismatch, once the grace is over.

A handshake failure that says why is reported at once; the other problems once the link
has been down for `grace` seconds; and every problem again every `repeat` seconds while it
lasts, so a broken link is one line a minute, never a flood.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

import zmq

__all__ = ["LINK_EVENTS", "LinkWatch"]

# What the SUB socket's monitor reports: the link is up once the ZMTP handshake succeeded
# (for every mechanism: a TCP connection refused at the handshake is no publisher).
LINK_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
)
_MECHANISM_MISMATCH = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
_CUT = (errno.EPIPE, errno.ECONNRESET)  # the peer closed the connection mid-handshake


@dataclass(slots=True)
class LinkWatch:
    """The link to one publisher: whether it is up, and if not, why."""

    endpoint: str
    curve: bool
    since: float  # when the link was last seen up, or the watch began
    grace: float = 3.0
    repeat: float = 60.0
    up: bool = False
    problem: str | None = None  # the diagnosis, once made
    _attempts: int = 0  # connect attempts started since the link went down
    _unresolved: bool = False  # the last retry came without an attempt started
    _tcp: bool = False  # TCP connected since the link went down, with no handshake
    _handshake: str | None = None  # how the last handshake failed
    _specific: str | None = None  # the last failure that said why (mechanism, ZAP)
    _cut: bool = False  # the last handshake failure without detail was a cut
    _cut_said: bool = False  # a cut handshake was reported as the likely mismatch
    _next_report: float | None = None

    def __post_init__(self) -> None:
        self._next_report = self.since + self.grace

    # -- events ------------------------------------------------------------------------

    def on_event(self, event: int, value: int, now: float) -> str | None:
        """Take one monitor event; returns a problem to report now (a failed handshake)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._set_up(now)
        elif event == zmq.EVENT_DISCONNECTED:
            if self.up:
                self._set_down(now)
        elif event == zmq.EVENT_CONNECT_DELAYED:
            self._attempts += 1
            self._unresolved = False
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._unresolved = self._attempts == 0
            self._attempts = 0
        elif event == zmq.EVENT_CONNECTED:
            self._tcp = True
            self._attempts += 1
        else:
            return self._handshake_failed(event, value, now)
        return None

    def _set_up(self, now: float) -> None:
        self.up, self.problem, self._handshake, self._specific = True, None, None, None
        self._cut = self._cut_said = False
        self._tcp = False
        self._next_report = None

    def _set_down(self, now: float) -> None:
        self.up = False
        self.since = now
        self._attempts, self._unresolved, self._tcp = 0, False, False
        self._next_report = now + self.grace

    def _handshake_failed(self, event: int, value: int, now: float) -> str | None:
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # Often followed by a specific failure of the same attempt: keep the specific
            # one if known, and say this one only when the grace is over.
            if self._specific is None:
                self._handshake = self._handshake_reason(event, value)
                self._cut = value in _CUT
            return None
        reason = self._handshake_reason(event, value)
        # The mismatch a reported cut foretold is said in its exact words from now on,
        # not as news.
        foretold = self._cut_said and value == _MECHANISM_MISMATCH
        first = reason != self._specific and not foretold
        self._handshake = self._specific = self.problem = reason
        if first:  # at once, the first time; then at the usual pace
            self._next_report = now + self.repeat
            return reason
        return None

    def _handshake_reason(self, event: int, value: int) -> str:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"the server refused our CURVE client key (ZAP status {value}): add its "
                "public key to the relay's --allow list, or give the right client_key"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
            if self.curve:
                return (
                    "handshake failed: the publisher does not use CURVE (a plain vLLM "
                    "publisher?); drop curve= (watch: --curve)"
                )
            return (
                "handshake failed: the publisher requires CURVE (a kvindex relay?); give its "
                "public key as curve=KEY and client_key=FILE (watch: --curve, --client-key)"
            )
        cut = event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in _CUT
        if self.curve:
            reason = (
                "CURVE handshake failed: is curve= the server's public key? (a wrong server "
                "key gives no other detail)"
            )
            if cut:
                reason += (
                    "; or the publisher does not use CURVE (a plain vLLM publisher?): then "
                    "drop curve= (watch: --curve)"
                )
            return reason
        if cut:
            return (
                "the publisher cut the ZMTP handshake, as one that requires CURVE does (a "
                "kvindex relay?): give its public key as curve=KEY and client_key=FILE "
                "(watch: --curve, --client-key)"
            )
        return f"ZMTP handshake failed (error {value})"

    # -- time --------------------------------------------------------------------------

    @property
    def next_deadline(self) -> float | None:
        return None if self.up else self._next_report

    def on_tick(self, now: float) -> str | None:
        """The problem to report now, if one is due (the grace or the repeat passed)."""
        due = self._next_report
        if self.up or due is None or now < due:
            return None
        self._next_report = now + self.repeat
        self.problem = self._diagnose()
        # With no specific failure known, a cut is what `_diagnose` said (its `_handshake`).
        self._cut_said = self._cut and self._specific is None
        return self.problem

    def _diagnose(self) -> str:
        if self._handshake is not None:
            return self._handshake
        if self._unresolved:
            host = _host(self.endpoint)
            return f"can't resolve {host!r}: check the host name"
        if self._tcp:
            return (
                "something accepts connections there but does not speak ZMQ: is it the "
                "engine's KV-events port (not its HTTP port)?"
            )
        return (
            "nothing accepts connections there: is the engine up and publishing KV events "
            "on that port (--kv-events-config), and the port reachable from here?"
        )


def _host(endpoint: str) -> str:
    address = endpoint.split("://", 1)[-1]
    host, _, _ = address.rpartition(":")
    return host.strip("[]") or address
