"""Our flags on upstream's parser and ServerArgs, and their validation in upstream's resolution steps."""
