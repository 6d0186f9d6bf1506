"""``PromptTokenizer`` implementations: any Hugging Face tokenizer, the fake's byte tokenizer, and a
model folder's tokenizer loaded without its weights."""
