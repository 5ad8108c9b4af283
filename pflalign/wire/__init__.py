"""What crosses between server and clients: wire names, message types, flat state, key binding."""
