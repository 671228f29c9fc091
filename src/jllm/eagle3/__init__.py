"""EAGLE-3 draft heads in llama.cpp's `eagle3` GGUF layout: the format (format.py) and the head (head.py)."""
