"""References and media: reading images, videos and sound, reference preparation, resampling, mp4 muxing."""
