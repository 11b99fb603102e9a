"""See DESIGN.md, Layout."""
