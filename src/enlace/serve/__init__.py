"""`enlace serve`: an OpenAI-compatible HTTP server and a chat page over ENLACE's own generation."""
