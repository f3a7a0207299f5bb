"""The workers and the work: models and placement, supervisors, the channel and links,
routing, admission, the queues and dispatch. Sees jobs of token ids, never a chat
(never imports ``router.chat``)."""
