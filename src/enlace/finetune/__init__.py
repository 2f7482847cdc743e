"""Fine-tuning Llama-family models with LoRA: loading Hugging Face folders and GGUF files, adapters in
PEFT's layout, instruction data with assistant-only loss, training, evaluation and chat."""
