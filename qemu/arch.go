package qemu

import (
	"fmt"
	"runtime"
)

// Arch is a guest architecture, named as QEMU names it (qemu-system-<arch>).
type Arch string

const (
	ArchX86_64  Arch = "x86_64"
	ArchAArch64 Arch = "aarch64"
)

// Arches are the supported guest architectures.
var Arches = []Arch{ArchX86_64, ArchAArch64}

// archInfo is what differs between guest architectures. Plain data.
type archInfo struct {
	goarch   string   // Go, Kubernetes (kubernetes.io/arch) and OCI platform name
	machines []string // valid Spec.Machine values; the first is the default
	console  string   // the kernel's name of the machine's first serial port
}

var archs = map[Arch]archInfo{
	ArchX86_64:  {goarch: "amd64", machines: []string{"q35", "pc", "microvm"}, console: "ttyS0"},
	ArchAArch64: {goarch: "arm64", machines: []string{"virt"}, console: "ttyAMA0"},
}

// Valid reports whether a is a supported guest architecture.
func (a Arch) Valid() bool { _, ok := archs[a]; return ok }

// GOARCH is the architecture's Go, Kubernetes (label kubernetes.io/arch) and
// OCI platform name: amd64, arm64.
func (a Arch) GOARCH() string { return archs[a].goarch }

// Binary is the QEMU system emulator of the architecture, looked up in $PATH.
func (a Arch) Binary() string { return "qemu-system-" + string(a) }

// DefaultMachine is the machine type a Spec gets when it names none: q35
// for x86_64, virt for aarch64.
func (a Arch) DefaultMachine() string {
	if m := archs[a].machines; len(m) > 0 {
		return m[0]
	}
	return ""
}

// Machines are the machine types supported for the architecture.
func (a Arch) Machines() []string { return append([]string(nil), archs[a].machines...) }

// KernelConsole is the kernel's console= argument for the serial port a
// Spec wires to console.log/console.sock: console=ttyS0 on x86_64 (8250
// UART), console=ttyAMA0 on aarch64 virt (PL011).
func (a Arch) KernelConsole() string { return "console=" + archs[a].console }

// ParseArch accepts a QEMU name (x86_64, aarch64) or a Go/Kubernetes name
// (amd64, arm64).
func ParseArch(s string) (Arch, error) {
	for a, info := range archs {
		if s == string(a) || s == info.goarch {
			return a, nil
		}
	}
	return "", fmt.Errorf("unknown architecture %q (want amd64/x86_64 or arm64/aarch64)", s)
}

// HostArch is the architecture of this host ("" when it is none of Arches).
func HostArch() Arch {
	a, err := ParseArch(runtime.GOARCH)
	if err != nil {
		return ""
	}
	return a
}

// CanKVM reports whether KVM can run guests of arch a on this host: only
// the host's own architecture.
func (a Arch) CanKVM() bool { return a != "" && a == HostArch() }
