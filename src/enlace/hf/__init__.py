"""Hugging Face (and GGUF) interchange beside the model: folders, configs, tokenizers, state-dict names.

`state_dict_adapter` maps our parameter names to Hugging Face's and llama.cpp's; `folder` reads and writes
transformers folders; `export` turns a training run into one; `gguf_import` / `gguf_export` go to and
from llama.cpp's format; `sp_convert` builds a `tokenizers` tokenizer.json equal to our sentencepiece model.
"""
