"""The HTTP server: FastAPI app around one Engine and the program executor."""
