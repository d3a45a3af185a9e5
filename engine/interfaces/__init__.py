"""The three plug-in interfaces the engine owns: KV-cache strategy, scheduler, attention backend.

The engine depends only on these Protocols (and the types they pass); ``strategies/`` implements
them and imports the engine, never the reverse. The engine builds a strategy by name through
Hydra's ``instantiate`` on ``conf/<group>/<name>.yaml`` — the only registry.
"""
