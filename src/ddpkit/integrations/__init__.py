"""Optional integrations with other libraries (layer 7); each imports its library only inside its own module."""
