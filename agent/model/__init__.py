"""The model's files: hyperparameters (spec), weights in one canonical form (checkpoint) read from
each format (formats/), GGUF Q4_1 blocks (quantized), tokenizer and incremental detokenizer. Numpy,
tokenizers and gguf only: the server and the tools read them without MindSpore (a .ckpt file, read by
MindSpore, imports it only when one is loaded)."""
