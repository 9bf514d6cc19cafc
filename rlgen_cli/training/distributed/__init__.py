"""Several processes as one: gradient synchronisation, exact reductions and fp16 loss scaling."""
