"""Hugging Face (and GGUF) interchange beside the model: folders, configs, tokenizers, state-dict names.

`arch` holds one module per architecture (llama, qwen3, gemma3: config.json, GGUF metadata and tensor names
both ways) and the registry that finds it; `folder` reads and writes transformers folders; `gguf_import` /
`gguf_export` go to and from llama.cpp's format (`gguf_gemma`: Gemma's tokenizer and chat format there);
`sp_convert` builds a `tokenizers` tokenizer.json equal to our sentencepiece model.
"""
