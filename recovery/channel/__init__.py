"""The authenticated transport every tier uses: the RAM tier's buddy copies and the live heals."""
