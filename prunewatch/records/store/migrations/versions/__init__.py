"""Migration revisions, oldest first: 0001 is the schema the embedded collector first shipped."""
