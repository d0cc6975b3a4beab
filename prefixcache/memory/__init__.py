"""Host memory on a restore's way: host views, restore buffers, copies."""
