"""OpenAI's API: /v1/completions, /v1/chat/completions, /v1/embeddings, /tokenize and
/detokenize, with their request and response models, tools, reasoning parsers, logprobs and
server-sent events. `serving.py` holds what every endpoint shares (OpenAIServer)."""
