"""The probe engine: real-device memory measurements (torch imported only inside functions)."""
