"""OpenAI Responses (`/v1/responses`): its format layer (`wire`) and restore rounds (`restore`)."""
