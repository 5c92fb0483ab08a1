package testutil

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Parts of a QEMU process's memory, as QEMUMemory sorts its mappings.
const (
	// PartGuestRAM: the guest's RAM (the memory backend's anonymous
	// mapping): the guest pages touched so far.
	PartGuestRAM = "guest-ram"
	// PartTCG: TCG's translation buffer (the anonymous executable mapping,
	// or the tcg-jit memfd with split W^X).
	PartTCG = "tcg-buffer"
	// PartBlobs: the kernel and initrd QEMU loads for a direct boot: the
	// files it maps, and its anonymous copies of them (glibc mmaps
	// allocations that large: a mapping of about a blob's size).
	PartBlobs = "kernel-initrd"
	// PartHeap: QEMU's own heap: [heap], glibc's malloc arenas and every
	// other anonymous mapping (large allocations, thread stacks).
	PartHeap = "heap"
	// PartFiles: file-backed mappings: the QEMU binary, shared libraries,
	// locale and other files QEMU maps.
	PartFiles = "files"
	// PartOther: the kernel's special mappings ([stack], [vdso], [vvar]).
	PartOther = "other"
)

// MemParts lists the parts in the order they are reported.
var MemParts = []string{PartGuestRAM, PartTCG, PartBlobs, PartHeap, PartFiles, PartOther}

// MemUse is the resident, proportional and anonymous memory of some
// mappings, in bytes.
type MemUse struct{ RSS, PSS, Anon int64 }

func (u *MemUse) add(v MemUse) { u.RSS, u.PSS, u.Anon = u.RSS+v.RSS, u.PSS+v.PSS, u.Anon+v.Anon }

// MemHints are what QEMUMemory knows of the VM to tell its mappings apart.
type MemHints struct {
	// GuestRAMBytes is the guest's RAM size: the anonymous mapping of that
	// size (up to 4 MiB more, QEMU's alignment) is the guest's.
	GuestRAMBytes int64
	// Blobs are the kernel and initrd files QEMU loads: a mapping of one
	// is the blob, and so is an anonymous mapping within 64 KiB of a
	// blob's size (QEMU's copy: a bzImage without its setup sectors, plus
	// malloc's header and page rounding) that does not start on a
	// malloc arena's 64 MiB boundary.
	Blobs []Blob
}

// Blob is a file QEMU loads: its path and size.
type Blob struct {
	Path  string
	Bytes int64
}

// BlobsOf returns the Blobs of the files at paths ("" skipped).
func BlobsOf(paths ...string) ([]Blob, error) {
	var out []Blob
	for _, p := range paths {
		if p == "" {
			continue
		}
		fi, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		out = append(out, Blob{Path: p, Bytes: fi.Size()})
	}
	return out, nil
}

// QEMUMemory is where a QEMU process's memory goes: each part's use and
// the page tables' size (VmPTE of /proc/PID/status).
type QEMUMemory struct {
	Parts          map[string]MemUse
	PageTableBytes int64
}

// ReadQEMUMemory reads /proc/PID/smaps and status and sorts the mappings
// into parts (ClassifySmaps).
func ReadQEMUMemory(pid int, h MemHints) (QEMUMemory, error) {
	smaps, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return QEMUMemory{}, fmt.Errorf("memory of QEMU %d: %w", pid, err)
	}
	parts, err := ClassifySmaps(smaps, h)
	if err != nil {
		return QEMUMemory{}, fmt.Errorf("memory of QEMU %d: %w", pid, err)
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return QEMUMemory{}, fmt.Errorf("memory of QEMU %d: %w", pid, err)
	}
	pte, err := statusKB(status, "VmPTE:")
	if err != nil {
		return QEMUMemory{}, fmt.Errorf("memory of QEMU %d: /proc/%d/status: %w", pid, pid, err)
	}
	return QEMUMemory{Parts: parts, PageTableBytes: pte << 10}, nil
}

func statusKB(status []byte, key string) (int64, error) {
	for _, l := range strings.Split(string(status), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == key {
			return strconv.ParseInt(f[1], 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s line", key)
}

// smapsMapping is one mapping of /proc/PID/smaps.
type smapsMapping struct {
	perms, path string
	start, size int64
	use         MemUse
}

// ClassifySmaps sorts the mappings of a QEMU's /proc/PID/smaps into parts
// (MemParts) and sums each part's use. Pure.
func ClassifySmaps(smaps []byte, h MemHints) (map[string]MemUse, error) {
	maps, err := parseSmaps(smaps)
	if err != nil {
		return nil, err
	}
	out := map[string]MemUse{}
	for _, m := range maps {
		part := m.part(h)
		u := out[part]
		u.add(m.use)
		out[part] = u
	}
	return out, nil
}

func (m smapsMapping) part(h MemHints) string {
	for _, b := range h.Blobs {
		if m.path == b.Path {
			return PartBlobs
		}
	}
	switch {
	case strings.Contains(m.path, "tcg-jit"):
		return PartTCG
	case strings.HasPrefix(m.path, "/"):
		return PartFiles
	case m.path == "[heap]":
		return PartHeap
	case strings.HasPrefix(m.path, "["):
		return PartOther
	case m.path != "":
		return PartFiles
	case strings.Contains(m.perms, "x"):
		return PartTCG
	case h.GuestRAMBytes > 0 && m.size >= h.GuestRAMBytes && m.size <= h.GuestRAMBytes+4<<20:
		return PartGuestRAM
	}
	const arenaAlign = 64 << 20
	for _, b := range h.Blobs {
		if d := m.size - b.Bytes; b.Bytes > 0 && d >= -64<<10 && d <= 64<<10 && m.start%arenaAlign != 0 {
			return PartBlobs
		}
	}
	return PartHeap
}

// parseSmaps reads the mappings of /proc/PID/smaps: a header line
// ("start-end perms offset dev inode [path]") then "Key: N kB" lines.
func parseSmaps(b []byte) ([]smapsMapping, error) {
	var out []smapsMapping
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		if strings.HasSuffix(f[0], ":") {
			if len(out) == 0 {
				return nil, fmt.Errorf("smaps line %d: %q before any mapping", n, sc.Text())
			}
			if len(f) == 3 && f[2] == "kB" {
				v, err := strconv.ParseInt(f[1], 10, 64)
				if err != nil {
					return nil, fmt.Errorf("smaps line %d: %w", n, err)
				}
				m := &out[len(out)-1]
				switch f[0] {
				case "Size:":
					m.size = v << 10
				case "Rss:":
					m.use.RSS = v << 10
				case "Pss:":
					m.use.PSS = v << 10
				case "Anonymous:":
					m.use.Anon = v << 10
				}
			}
			continue
		}
		if len(f) < 5 || !strings.Contains(f[0], "-") {
			return nil, fmt.Errorf("smaps line %d: not a mapping header: %q", n, sc.Text())
		}
		start, _, _ := strings.Cut(f[0], "-")
		addr, err := strconv.ParseUint(start, 16, 64)
		if err != nil {
			return nil, fmt.Errorf("smaps line %d: mapping address: %w", n, err)
		}
		m := smapsMapping{perms: f[1], start: int64(addr)}
		if len(f) > 5 {
			m.path = strings.Join(f[5:], " ")
		}
		out = append(out, m)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("smaps: %w", err)
	}
	return out, nil
}
