"""One module per provider surface: its request models, its conversion to and from the canonical request, and its
routes (`register(app, service)`). The API-neutral core they share is the rest of `polar_lab.proxy`."""

from polar_lab.proxy.apis import anthropic, google, openai_chat, openai_responses, tokenize

SURFACES = (openai_chat, openai_responses, anthropic, google, tokenize)  # each adds its routes to the app

__all__ = ["SURFACES", "anthropic", "google", "openai_chat", "openai_responses", "tokenize"]
