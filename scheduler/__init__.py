"""The async face of the engine, on anyio."""
