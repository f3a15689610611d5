"""The module roles of a vision-language model. Every parameter belongs to exactly one (a family says which
by module path), and a recipe stage trains each role one way: frozen, lora or full. Import-light: the
recipe schema reads it before torch is imported."""

ROLES = ("vision", "projector", "llm")
