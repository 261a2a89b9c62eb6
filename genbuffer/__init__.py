"""Privacy-preserving synthetic image buffers (conditional StyleGAN2-ADA + LPIPS)."""
