"""Settings written as text (flags, flag files) -> values: the parsers of Config's fields that are not a plain
number, name or switch, and the tf.data service's address. Each raises ConfigError with the flag's name."""

from typing import Optional, Tuple
from urllib.parse import urlparse

from imagenet_tpu.errors import ConfigError


def parse_mesh_shape(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """'16x32' -> (16, 32); empty stays None."""
    if not text:
        return None
    try:
        x, y = (int(part) for part in text.lower().split('x'))
    except ValueError:
        raise ConfigError(f'--mesh_shape must look like 16x32 (chips in x and y), got {text!r}') from None
    return x, y


def parse_step_range(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """'100,110' -> (100, 110): steps START..END (both counted from the run's first step, 1), START <= END;
    empty stays None."""
    if not text:
        return None
    try:
        start, end = (int(part) for part in text.split(','))
    except ValueError:
        raise ConfigError(f'--profile_steps must be START,END (steps, e.g. 100,110), got {text!r}') from None
    if not 1 <= start <= end:
        raise ConfigError(f'--profile_steps must have 1 <= START <= END, got {text!r}')
    return start, end


SERVICE_PROTOCOL = 'grpc'


def parse_service_address(address: str) -> Tuple[str, int]:
    """(host, port) of a tf.data service dispatcher's 'grpc://HOST:PORT'; ConfigError otherwise."""
    parsed = urlparse(address)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != SERVICE_PROTOCOL or not parsed.hostname or not port or parsed.path not in ('', '/'):
        raise ConfigError(f'--data_service must be grpc://HOST:PORT (the dispatcher), got {address!r}')
    return parsed.hostname, port


def parse_floats(items) -> Tuple[float, ...]:
    """['30', '60'] or '30,60' -> (30.0, 60.0)."""
    if isinstance(items, str):
        items = [item for item in items.split(',') if item.strip()]
    try:
        return tuple(float(item) for item in items)
    except ValueError:
        raise ConfigError(f'expected a comma-separated list of numbers, got {",".join(items)!r}') from None
