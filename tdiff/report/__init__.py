"""Reports: the terminal table (console), and write-ups for pull requests.

model (typed records from a CompareReport) -> document (headings, paragraphs, tables) ->
markdown / html (with plots); progress draws the bars every command shares.
"""
