"""routeplay.integrations: adapters to trainers that bring their own replay primitives.

``routeplay.integrations.megatron`` fills Megatron-Core's ``RouterReplay`` from the
materializer's rows. Integrations sit on top of ``train``; nothing below imports them.
"""
