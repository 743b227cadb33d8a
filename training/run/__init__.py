"""How it is trained: one core (``core``), two drivers (``single``, ``distributed``) and their parts."""
