"""HyMCache: a multi-turn prefix KV-cache tier over CXL-HM devices.

Processes (each also a plain class, used in process by tests and replay):
Master (``master.py``: global block metadata), one KV Manager per storage node
(``manager.py``: explicit device prefetch in a bounded window per request),
and, inside a serving engine, Lookup (``lookup.py``) and the KV Connector
(``connector.py``: vLLM's KV connector v1 interface). They talk over ZeroMQ
(``rpc.py``) with msgspec-encoded messages (``messages.py``).
"""
