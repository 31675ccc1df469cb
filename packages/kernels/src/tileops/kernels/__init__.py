"""tileops.kernels: TileLang kernels, one family a module."""
