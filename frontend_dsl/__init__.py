"""The forklm program language (see issue 5)."""
