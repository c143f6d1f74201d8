"""The async-I/O layer: probes, engines, aligned buffers and swap files (DESIGN §3)."""
__all__: list[str] = []
