"""An SSD tier directory opened for inspection and maintenance; serving never imports it."""
