package qemu

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// prepareStateDir makes spec's state dir (spec.StateDir, absolute) ready
// for a new QEMU: created 0700 and holding no live QEMU; stale sockets,
// pidfile and exit record removed; console.log kept as
// console.previous.log; the UEFI vars copied on the first start; the spec
// written.
func prepareStateDir(spec Spec) error {
	abs := spec.StateDir
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return fmt.Errorf("create state dir: %w", err)
	}
	if err := os.Chmod(abs, 0o700); err != nil {
		return fmt.Errorf("chmod state dir: %w", err)
	}
	if pid, err := readPidfile(abs); err == nil && qemuAlive(pid, abs) {
		return fmt.Errorf("state dir %s: QEMU pid %d is still running there (use Adopt)", abs, pid)
	}
	for _, n := range []string{QMPSocketName, ConsoleSocketName, GuestAgentSocketName, PidfileName, ExitFileName, MigrateSocketName, VNCSocketName} {
		if err := os.Remove(spec.Path(n)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove stale %s: %w", n, err)
		}
	}
	if _, err := os.Stat(spec.Path(ConsoleLogName)); err == nil {
		if err := os.Rename(spec.Path(ConsoleLogName), spec.Path(ConsolePreviousLogName)); err != nil {
			return fmt.Errorf("keep previous console log: %w", err)
		}
		os.Remove(spec.Path(ConsoleLogName + ".1"))
	}
	if spec.Firmware == FirmwareUEFI {
		if _, err := os.Stat(spec.Path(UEFIVarsName)); errors.Is(err, os.ErrNotExist) {
			if err := copyFile(spec.UEFIVarsTemplate, spec.Path(UEFIVarsName)); err != nil {
				return fmt.Errorf("copy UEFI vars: %w", err)
			}
		}
	}
	specJSON, _ := json.MarshalIndent(spec, "", "  ")
	return writeFileAtomic(spec.Path(SpecFileName), specJSON, 0o600)
}

// CleanStateDir removes everything in dir except names matching keep
// (filepath.Match patterns); with no keep the dir itself goes.
func CleanStateDir(dir string, keep []string) error {
	if len(keep) == 0 {
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("remove state dir %s: %w", dir, err)
		}
		return nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("clean state dir %s: %w", dir, err)
	}
	var errs []error
	for _, e := range ents {
		kept := false
		for _, k := range keep {
			if ok, _ := filepath.Match(k, e.Name()); ok {
				kept = true
				break
			}
		}
		if !kept {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clean state dir %s: %w", dir, err)
	}
	return nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
