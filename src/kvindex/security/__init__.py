"""`kvindex.security`: CURVE keys for encrypted, authenticated ZMQ links, and the HTTP
API's bearer tokens and limits. See docs/security.md."""
