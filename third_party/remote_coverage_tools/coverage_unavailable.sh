#!/bin/sh
echo "coverage is not available in the offline build" >&2
exit 1
