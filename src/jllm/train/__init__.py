"""Training an EAGLE-3 draft head for a GGUF target, end to end (issue 26, part 4).

    python -m jllm.train.head -m TARGET.gguf -o HEAD.gguf [--device cuda]

target.py   the target as a Hugging Face model built from the GGUF's own weights (dequantized): batched
            generation and the three layers' hidden states with its logits
data.py     self-distilled conversations (Magpie user turns, prompts made from installed packages' files;
            the target's own replies), kept as token ids in one .npz; the draft vocabulary
eagle3.py   the head and its training-time test (several unrolled draft steps, a loss at each)
export.py   the head written in llama.cpp's eagle3 GGUF layout, quantized, with the target's tokenizer
head.py     the command that runs the four
"""
