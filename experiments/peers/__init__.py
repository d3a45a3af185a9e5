"""Other serving systems behind the harness's engine surface: Hugging Face, llama.cpp, and the peer table."""
