"""Anthropic Messages (`/v1/messages`): its format layer (`wire`), its prompt-cache breakpoint
(`cache`) and its restore rounds (`restore`)."""
