"""interop — other people's formats: Hugging Face folders and models (hf.py, convert.py), Megatron-core checkpoints
(convert.py), tokenizer files and chat templates (tokenizer_files.py), Megatron-LM's flags (megatron_flags.py).
Nothing here teaches how Megatron trains; it lets the teaching core read and write what others use."""
