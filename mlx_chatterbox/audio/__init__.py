"""The signal front-end: audio files, resampling, spectrograms and filterbanks, with upstream's conventions."""
