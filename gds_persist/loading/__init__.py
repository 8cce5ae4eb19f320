"""Loading: the one load orchestrator (:mod:`.load`), the one read loop (:mod:`.extents`),
``verify`` (:mod:`.verify`), and where the bytes of a load land (:mod:`.destinations`)."""
