"""The arithmetic the catalogue's entries put in place (catalogue.yaml says where each goes)."""
