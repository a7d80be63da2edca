"""Anthropic's Messages API: its request mapping, content-block encoder and errors."""
