"""What the service keeps between requests and replicas: bias and positional profiles, the
sampled runs they are calibrated from, and the locks, in a folder or in Redis.

Imports only ``config``, ``errors`` and itself: state never knows strategies, prompts,
backends or the learner that writes it.
"""
