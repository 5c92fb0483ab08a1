package jumpstarter

import "fmt"

// The report's description and methods_description of each driver.
// Upstream's exporter fills them from its configuration (a driver's
// `description:` and `methods_description:`), and its client classes use
// them as the `j` command line's help: description replaces the help of
// the driver's command group, methods_description[cmd] the help of its
// subcommand cmd (jumpstarter/client/decorators.py: DriverClickGroup). So
// the keys are the command names of each client class's cli(), and the
// texts say what that command does on a VM of ours where it differs from
// what upstream's own help promises.

// help is one driver's description and methods_description.
type help struct {
	description string
	methods     map[string]string
}

// helpOf returns the help of a driver of kind k (port: the guest port of
// a kindPort child).
func helpOf(k driverKind, port int) help {
	switch k {
	case kindRoot:
		// QemuClient's own commands are the resize group, which
		// methods_description does not reach (only DriverClickGroup.command
		// reads it).
		return help{description: "QEMU virtual machine (a qemu-kubelet VM pod)"}
	case kindPower:
		// PowerClient.cli: on, off, cycle, read.
		return help{description: "VM power", methods: map[string]string{
			"on":    "Power on: boot the VM from a fresh overlay of its image (the flashed one, if any)",
			"off":   "Power off at once: QEMU is stopped (killed if it has not quit within 5 s), the guest is not shut down; the driver call `shutdown` powers off gracefully (ACPI power button)",
			"cycle": "Power cycle: off at once, wait, on",
			"read":  "Not supported: a VM has no power meter",
		}}
	case kindFlasher:
		// FlasherClient.cli: flash, dump.
		return help{description: "Flash and dump the VM's disk and firmware", methods: map[string]string{
			"flash": "Flash FILE, an http(s):// URL or oci://REF onto a partition (--target root, bios, OVMF_CODE.fd or OVMF_VARS.fd); the VM is powered off for the swap and on again if it was on",
			"dump":  "Dump a partition (--target, default root) to FILE: root is the disk as the guest left it (power off first); flashed:PARTITION is what was flashed there, or the pod's image's disk",
		}}
	case kindConsole:
		// PySerialClient.cli: start-console, pipe.
		return help{description: "VM serial console (the stream kubectl attach shows)", methods: map[string]string{
			"start-console": "Start the serial console (exit with CTRL+B x 3 times); sessions of the lease type together, as on a pty",
			"pipe":          "Pipe the serial console to stdout or a file; piped stdin goes to the guest, and its end ends the stream (a serial line has no end of input)",
		}}
	case kindDisplay:
		return help{description: "VM display (QEMU's VNC server)", methods: networkMethods("the VM's VNC server")}
	case kindPort:
		return help{description: fmt.Sprintf("TCP to guest port %d", port), methods: networkMethods(fmt.Sprintf("guest port %d", port))}
	}
	return help{}
}

// networkMethods is the help of NetworkClient.cli's commands (forward-tcp,
// forward-unix, address) for a stream to what.
func networkMethods(what string) map[string]string {
	return map[string]string{
		"forward-tcp":  "Forward a local TCP port to " + what,
		"forward-unix": "Forward a local unix socket to " + what,
		"address":      "Not supported: " + what + " is reached through the router only (use forward-tcp)",
	}
}
