"""Reports: the terminal table now; Markdown and HTML for pull requests."""
