"""The C lookup thread (_lookupd.c); kvindex.service.lookupd drives it."""

class Server:
    def __init__(
        self,
        api: object,
        core: object,
        fd: int,
        max_body: int,
        max_items: int,
        head_limit: int,
        token: bytes | None,
        hosts: list[bytes] | None,
        headers: bytes,
        date: bool,
        keep_alive: float,
        handoff_after: float,
    ) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def set_answer(
        self, slots: list[tuple[bytes, list[int]]], statuses: list[bytes], sources_gen: int, /
    ) -> None: ...
    def take(self) -> list[tuple[int, bytes]]: ...
    def samples(self) -> list[tuple[float, bool]]: ...
    def counts(self) -> tuple[int, int, int, int]: ...
    def fileno(self) -> int: ...
