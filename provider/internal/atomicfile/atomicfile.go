// Package atomicfile writes the provider's records (pod.json, status.json,
// retained.json) so that a reader sees the old or the new content, never a
// part.
package atomicfile

import (
	"encoding/json"
	"os"
)

// Write writes path through path.tmp (synced, then renamed), so a reader
// sees the old or the new content, never a part; the tmp file is removed
// when any step fails.
func Write(path string, b []byte) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		os.Remove(tmp)
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(tmp)
		return err
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// WriteJSON writes v as indented JSON (Write).
func WriteJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return Write(path, append(b, '\n'))
}
