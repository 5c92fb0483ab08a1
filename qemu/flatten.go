package qemu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
)

// FlattenDisk writes a standalone qcow2 copy of the disk at src (its
// backing chain merged in, so the copy needs no base image) at dst. dst
// appears complete or not at all: the copy is written next to it, synced,
// and renamed into place; a copy left by an interrupted call is replaced.
// src must not be in use by a running VM. dst must not exist.
func FlattenDisk(ctx context.Context, src, dst string) error {
	if _, err := os.Stat(src); err != nil {
		return fmt.Errorf("flatten disk %s: %w", src, err)
	}
	if _, err := os.Stat(dst); err == nil {
		return fmt.Errorf("flatten disk %s: %s already exists", src, dst)
	}
	tmp := dst + ".tmp"
	if err := os.Remove(tmp); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("flatten disk %s: remove stale %s: %w", src, tmp, err)
	}
	if _, err := runTool(ctx, QEMUImgBinary, "convert", "-q", "-O", "qcow2", src, tmp); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("flatten disk %s: %w", src, err)
	}
	if err := syncPath(tmp); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("flatten disk %s: %w", src, err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("flatten disk %s: %w", src, err)
	}
	if err := syncPath(filepath.Dir(dst)); err != nil {
		return fmt.Errorf("flatten disk %s: %w", src, err)
	}
	return nil
}

// syncPath fsyncs a file or directory.
func syncPath(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", path, err)
	}
	return nil
}
