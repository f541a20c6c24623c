"""Optional integrations with other libraries; each imports its library only inside its own module."""
