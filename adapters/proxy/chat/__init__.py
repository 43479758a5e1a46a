"""OpenAI chat completions (`/v1/chat/completions`): its format layer (`wire`) and restore rounds (`restore`)."""
