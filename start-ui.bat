@echo off
rem Start the Tandem GUI. First use creates .venv and installs Tandem into it.
setlocal
cd /d "%~dp0"
if not exist ".venv\Scripts\python.exe" (
    echo Creating .venv
    py -m venv .venv || goto :failed
    ".venv\Scripts\python.exe" -m pip install --upgrade pip || goto :failed
    ".venv\Scripts\python.exe" -m pip install -e . || goto :failed
)
".venv\Scripts\python.exe" scripts\train_ui.py %*
exit /b %errorlevel%
:failed
echo Setting up .venv failed; see the messages above. Python 3.10+ from python.org provides "py".
pause
exit /b 1
