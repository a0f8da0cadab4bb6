"""A Hadamard spec that tensor cores compute bit for bit (issue #30): the reference, and a prototype kernel."""
